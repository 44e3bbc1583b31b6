"""Protocol buffers of the pdserve APIs and their generated Python stubs (`python -m protos.generate`)."""
