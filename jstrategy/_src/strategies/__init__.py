"""The strategies: each file one row of the policy table over the core `Strategy`."""
