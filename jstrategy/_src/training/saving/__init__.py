"""What a `Model.save` directory holds: the saved config (written, read, checked) and the
directory itself (`SavingMixin`: `save`, `save_weights`, `load_weights`)."""
