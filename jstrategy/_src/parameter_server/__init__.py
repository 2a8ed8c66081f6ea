"""ParameterServerStrategy: variables on parameter servers, asynchronous workers."""
