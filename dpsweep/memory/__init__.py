"""Memory: the four stages of a first iteration, fitted memory models, and predictions before launch."""
