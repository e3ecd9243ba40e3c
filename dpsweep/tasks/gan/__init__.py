"""``task=gan``: private synthetic data from a conditional DP-WGAN-GP."""
