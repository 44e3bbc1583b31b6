"""pdserve protocol buffers."""
