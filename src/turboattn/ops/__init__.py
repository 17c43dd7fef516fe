"""Every kernel beside its PyTorch twin and its launch policy, one folder per op."""
