"""Router: worker pools on Ray, request orchestration (placement policy and APIs build on it)."""
