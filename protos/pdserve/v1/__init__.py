"""pdserve.v1: the gRPC generation API (pdserve.proto) and its generated stubs."""
