"""Built-in plugin: the pure-PyTorch reference expert backend."""
