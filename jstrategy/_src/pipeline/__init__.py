"""Pipeline parallelism: the strategy, the schedules, `Repeated` and the 1F1B loss."""
