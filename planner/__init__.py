"""`pdserve plan`: how many prefill and decode workers to run, found by simulating the serving code.

A simulated request arrives from a trace (`planner.traces`), is placed and booked by the router's own
`Policy` and `PoolBook`, and runs through simulated workers whose steps the engine's own `Scheduler`
and `BlockManager` decide and a cost model times (`planner.sim`; `planner.profiles`: measured or
roofline). `planner.plan` sweeps layouts, policies and batch limits and recommends one;
`planner.validate` replays a trace on a real server beside its simulation; `planner.watch` reads a
live server's metrics and recommends a new split.

Boundary rule: never imports Ray, no torch.
"""
