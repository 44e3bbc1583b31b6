"""`pdserve serve` configuration: flags, the YAML file (flags win), and validation naming the field."""
from __future__ import annotations

import pytest

from pdserve.cli import _apply_yaml, build_parser
from pdserve.serve import ServeConfig
from router.config import RouterConfig


def parse(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    return _apply_yaml(args, argv) if args.config else args


def test_yaml_values_apply_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("policy: always_local\nhttp-port: 9100\ngrpc_port: 9101\nprefill: 2\nttft_target: 1.5\n")
    args = parse(["serve", "--config", str(cfg), "--http-port", "9200"])
    assert args.policy == "always_local" and args.grpc_port == 9101 and args.prefill == 2
    assert args.ttft_target == 1.5
    assert args.http_port == 9200  # the command line wins


def test_yaml_unknown_key_is_named_with_the_allowed_ones(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("polcy: ratio\n")
    with pytest.raises(ValueError, match="polcy") as e:
        parse(["serve", "--config", str(cfg)])
    assert all(key in str(e.value) for key in ("'policy'", "'ttft_target'", "'kv_memory_gib'", "'api_key_file'"))


def test_every_flag_default_and_help_comes_from_its_config_field(capsys):
    """No number is restated in the CLI: a `serve` with no flags builds exactly `ServeConfig()` (threads
    aside: one per Ray CPU), and `generate` a plain `EngineConfig()`."""
    import dataclasses

    from engine import EngineConfig
    from pdserve import flags

    served = flags.build(ServeConfig(), parse(["serve"]), flags.ENGINE + flags.SERVE)
    assert served == ServeConfig()
    assert served.engine.compile is True and served.router == RouterConfig()
    generated = flags.build(ServeConfig(engine=EngineConfig()), build_parser().parse_args(["generate", "hi"]),
                            flags.ENGINE).engine
    assert generated == EngineConfig()
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for path in flags.ENGINE + flags.SERVE:
        f, _ = flags._field(ServeConfig(), path)
        assert flags.flag_name(f) in help_text and " ".join(f.metadata["help"].split())[:30] in help_text, path
    changed = parse(["serve", "--ttft-target", "0.5", "--kv-memory-gib", "2", "--prefill", "0", "--no-compile",
                     "--transfer-backend", "object_store"])
    cfg = flags.build(ServeConfig(), changed, flags.ENGINE + flags.SERVE)
    assert (cfg.router.ttft_target_s, cfg.engine.cache.memory_gib, cfg.num_prefill, cfg.engine.compile,
            cfg.transfer.backend) == (0.5, 2.0, 0, False, "object_store")
    assert dataclasses.replace(cfg.engine.cache, memory_gib=1.0) == ServeConfig().engine.cache
    alike = parse(["serve", "--port", "9300", "--max-num-batched-tokens", "4096", "--no-enable-prefix-caching",
                   "--seed", "7"])  # the flags vLLM users know
    cfg = flags.build(ServeConfig(), alike, flags.ENGINE + flags.SERVE)
    assert (cfg.http_port, cfg.engine.max_num_batched_tokens, cfg.engine.cache.enable_prefix_caching,
            cfg.engine.seed) == (9300, 4096, False, 7)


def test_yaml_must_be_a_mapping(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        parse(["serve", "--config", str(cfg)])


def test_defaults_bind_loopback():
    args = parse(["serve"])
    assert args.host == "127.0.0.1" and args.policy == "ratio" and args.prefill == 1 and args.decode == 1


def test_serve_defaults_to_dtype_auto_and_a_compiled_decode_step():
    args = parse(["serve"])
    assert args.dtype == "auto" and args.compile is True
    assert parse(["serve", "--no-compile", "--dtype", "float32"]).compile is False
    assert build_parser().parse_args(["generate", "hi"]).compile is False  # one prompt: compiling would not pay


def test_yaml_sets_dtype_and_compile(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("dtype: bfloat16\ncompile: false\n")
    args = parse(["serve", "--config", str(cfg)])
    assert args.dtype == "bfloat16" and args.compile is False


@pytest.mark.parametrize("argv,message", [
    (["serve", "--dtype", "float16"], "dtype float16 needs a CUDA device; on cpu use auto, bfloat16 or float32"),
    (["generate", "hi", "--dtype", "float16"], "dtype float16 needs a CUDA device"),
    (["serve", "--ssl-certfile", "cert.pem"], "ssl_certfile / ssl_keyfile: give both"),
    (["serve", "--ssl-certfile", "/nonexistent/cert.pem", "--ssl-keyfile", "/nonexistent/key.pem"],
     "ssl_certfile: cannot read /nonexistent/cert.pem"),
    (["generate", "hi", "--server", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], "tls_ca: cannot read"),
])
def test_bad_settings_are_refused_before_anything_starts(argv, message, capsys):
    from pdserve import cli

    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_an_unknown_dtype_is_refused_with_the_choices(capsys):
    from pdserve import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--dtype", "int8"])
    assert e.value.code == 2
    assert "invalid choice: 'int8' (choose from 'auto', 'float32', 'bfloat16', 'float16')" in capsys.readouterr().err


@pytest.mark.parametrize("kw,field", [({"num_decode": 0}, "decode"), ({"num_prefill": -1}, "prefill"),
                                      ({"http_port": 70000}, "http_port"), ({"cpus_per_worker": -1}, "cpus_per_worker"),
                                      ({"deployment": "prod"}, "deployment: needs --address"),
                                      ({"deployment": "a.b", "address": "auto"}, "deployment: letters")])
def test_serve_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kw)


@pytest.mark.parametrize("kw,field", [({"policy": "fastest"}, "policy"), ({"ttft_target_s": 0}, "ttft_target_s"),
                                      ({"max_queued": -1}, "max_queued"), ({"served_model_name": " "},
                                                                           "served_model_name"),
                                      ({"flip_roles": True, "policy": "always_local"}, "flip_roles")])
def test_router_config_validation_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**kw)


@pytest.mark.parametrize("address,calls,ok", [("ray://head:10001", 2, True), ("head:6379", 1, False)])
def test_a_ray_client_connection_that_fails_to_start_is_tried_again(monkeypatch, address, calls, ok):
    """ray:// only: the head's per-client server sometimes fails to start once under load."""
    import ray

    from pdserve import serve

    seen = []

    def init(**kw):
        seen.append(kw["address"])
        if len(seen) == 1:
            raise ConnectionAbortedError("Initialization failure from server:\nRuntimeError: Starting Ray client "
                                         "server failed.")
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(serve.time, "sleep", lambda s: None)
    cfg = ServeConfig(address=address)
    if ok:
        serve._connect(cfg)
    else:
        with pytest.raises(ConnectionAbortedError):
            serve._connect(cfg)
    assert seen == [address] * calls


def test_a_field_becomes_a_flag_only_with_help_and_a_plain_type():
    import argparse
    from dataclasses import dataclass, field

    from pdserve import flags

    @dataclass(frozen=True)
    class Odd:
        silent: int = 1
        listed: list = field(default_factory=list, metadata={"help": "a list"})

    with pytest.raises(TypeError, match="no help text"):
        flags.add_flags(argparse.ArgumentParser(), [("silent",)], Odd())
    with pytest.raises(TypeError, match="cannot be a flag"):
        flags.add_flags(argparse.ArgumentParser(), [("listed",)], Odd())


def test_only_a_prefill_worker_that_serves_decode_compiles_a_decode_step():
    from engine import EngineConfig
    from router.pools import role_config

    compiled = EngineConfig(compile=True)
    assert role_config("decode", compiled, prefill_decodes=False) is compiled
    assert role_config("prefill", compiled, prefill_decodes=True) is compiled  # role flips: it decodes too
    plain = role_config("prefill", compiled, prefill_decodes=False)
    assert plain.compile is False and plain == EngineConfig(compile=False)  # nothing else changes
    eager = EngineConfig(compile=False)
    assert role_config("decode", eager, prefill_decodes=True) is eager


def test_a_start_up_phase_abandoned_by_a_signal_ends_quietly_on_its_own_thread() -> None:
    """`serve` awaits a start-up phase (which blocks in Ray) on a daemon thread of its own, so an exit
    never waits for it; a signal abandons it, and when it ends later nothing is raised in its thread."""
    import asyncio
    import threading

    from pdserve.serve import _on_own_thread, _Stopped, _unless_stopped

    release, errors = threading.Event(), []

    def abandoned() -> int:
        release.wait(10)
        return 42
    threading.excepthook, hook = (lambda args: errors.append(args.exc_value)), threading.excepthook
    try:
        async def main() -> None:
            stop = asyncio.Event()
            asyncio.get_running_loop().call_later(0.05, stop.set)
            with pytest.raises(_Stopped):
                await _unless_stopped(stop, _on_own_thread(abandoned))
            assert await _unless_stopped(asyncio.Event(), _on_own_thread(lambda: 7)) == 7
            with pytest.raises(ValueError, match="bad"):
                await _unless_stopped(asyncio.Event(), _on_own_thread(int, "bad"))
        asyncio.run(main())  # returns without waiting for the abandoned phase
        phase = next(t for t in threading.enumerate() if t.name == "pdserve-abandoned")
        assert phase.daemon and phase.is_alive()
        release.set()
        phase.join(10)
        assert not phase.is_alive() and not errors
    finally:
        threading.excepthook = hook
