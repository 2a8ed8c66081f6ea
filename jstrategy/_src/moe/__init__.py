"""Mixture-of-experts layers (`jstrategy.experimental.MoE`, `NNXMoE`): routing, experts, losses."""
