"""How each DP mechanism trains: DP-SGD through Opacus, DP-FTRL, per-example steps in torch.func."""
