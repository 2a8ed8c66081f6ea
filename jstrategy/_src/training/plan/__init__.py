"""`jstrategy.experimental.plan`: will the train step fit, before any run (`planner.py`),
the largest batch that does (`search.py`), the compiler's refusal for memory read from its
error (`refusal.py`), and the record it returns, with its advice (`report.py`)."""
