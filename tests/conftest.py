"""Shared fixtures: fixed thread count, tiny random models, the transformers greedy oracle."""
from __future__ import annotations

import copy
import faulthandler
import os
from pathlib import Path

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PreTrainedModel,
                          Qwen2Config, Qwen2ForCausalLM)

torch.set_num_threads(2)
_crash_log = None


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    """With PDSERVE_CRASH_LOG set (`.ci/run` sets it), a fatal signal in the test process writes every
    thread's Python stack to that file, which `.ci/run` prints when the suite fails."""
    global _crash_log
    if path := os.environ.get("PDSERVE_CRASH_LOG"):
        _crash_log = open(path, "w")  # noqa: SIM115 - open for the life of the process
        faulthandler.enable(_crash_log, all_threads=True)

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None,
            pad_token_id=None, initializer_range=0.2)


@pytest.fixture(autouse=True, scope="module")
def _fresh_compiled_steps():
    """Each test module starts without the compiled decode steps of the modules before it (each engine's step is
    a code object of its own, `model_runner._compile_decode`; Dynamo's other caches go too)."""
    yield
    torch.compiler.reset()


def tiny_model(arch: str, seed: int = 0) -> PreTrainedModel:
    """A small randomly initialised decoder, fp32, with no EOS so lengths are exact."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**TINY))
    else:
        raise AssertionError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def greedy_reference(model: PreTrainedModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy `generate`, one sequence at a time (no padding)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(params=["llama", "qwen2", "mistral"])
def tiny_pair(request: pytest.FixtureRequest) -> tuple[PreTrainedModel, PreTrainedModel]:
    """(reference model, engine copy): the engine switches its copy's attention to the paged kernel."""
    ref = tiny_model(request.param)
    return ref, copy.deepcopy(ref)


def random_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost and its key, PEM files in `directory`."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path
