"""Benchmarks of pdserve: `pdserve bench engine|serve|compare|phases|report|soak`.

Running them needs the `bench` extra (`pip install 'pdserve[bench]'`). Building their flags, which
every `pdserve` command line does, needs none of it.
"""
