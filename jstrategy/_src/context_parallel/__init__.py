"""Context (sequence) parallelism: the step's context axis and the attention that reads it."""
