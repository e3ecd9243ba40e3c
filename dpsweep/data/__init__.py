"""Datasets: loaders, what planning needs to know of them without loading them, users, device-resident batches."""
