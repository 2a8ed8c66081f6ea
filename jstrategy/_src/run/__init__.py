"""`Strategy.run`'s machinery: the compiled program (`program.py`) and its debug check of
values that must be mirrored (`mirrored_check.py`)."""
