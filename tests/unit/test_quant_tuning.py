"""`profile` and `tune` know the codecs: decode speed measured per codec, a smaller codec named only where
loading, not recompute, sets the pace."""

from __future__ import annotations

import dataclasses

import torch

from tuning_helpers import CTX, synthetic_profile
from kvblend.archive import CODECS, encode_layer
from kvblend.tuning.codecs import CodecDecision, choose_codec
from kvblend.tuning.profile import Profile
from kvblend.tuning.sample import SampleKV
from kvblend.tuning.profiling import measure_codecs

RAW = 2 * 2 * 3 * 64  # fp16 K and V bytes per token-layer of a 3-head, 64-dim model
RATES = {"zstd-shuffle": {"stored_fraction": 0.85, "decompress_MBps": 400.0, "decompress_raw_MBps": 470.0},
         "int8": {"stored_fraction": 0.51, "decompress_MBps": 300.0, "decompress_raw_MBps": 590.0},
         "int4": {"stored_fraction": 0.30, "decompress_MBps": 150.0, "decompress_raw_MBps": 500.0}}


def profile(t_load_s: float, recompute_15_s: float) -> Profile:
    p = synthetic_profile("disk", t_load_s, recompute_15_s, bytes_per_token_layer=0.85 * RAW)
    return dataclasses.replace(p, codec="zstd-shuffle", decompress_MBps=400.0, kv_raw_bytes_per_token_layer=RAW,
                               codecs=RATES)


def test_profile_prices_each_codec_by_its_bytes_and_decode_rate():
    p = profile(0.010, 0.004)
    lossless, int4 = p.load_model(codec="zstd-shuffle"), p.load_model(codec="int4")
    assert lossless.bytes_per_token_layer == p.kv_bytes_per_token_layer  # the archive as it is
    assert int4.bytes_per_token_layer == RAW * 0.30 and int4.decompress_MBps == 150.0
    assert int4.time(CTX) < lossless.time(CTX)


def test_slow_storage_gets_the_most_faithful_codec_that_shortens_the_pace():
    p = profile(0.010, 0.012)  # lossless loads in ~17 ms a layer, int8 ~11, int4 ~10; recompute takes 12
    d = choose_codec(p, r_quality=0.15, L=CTX, cost_model=p.cost_model)
    assert d.current == "zstd-shuffle" and d.choice == "int8"  # int8 reaches the recompute floor: int4 gains nothing
    assert "--codec int8" in d.note
    paces = {o.codec: o.pace_s for o in d.options}
    assert paces["int8"] < paces["zstd-shuffle"]
    assert CodecDecision.from_dict(d.to_dict()) == d


def test_very_slow_storage_gets_int4_and_fast_storage_keeps_lossless():
    slow = profile(0.050, 0.004)
    assert choose_codec(slow, 0.15, CTX, slow.cost_model).choice == "int4"
    fast = profile(0.002, 0.020)  # loading already hidden behind recompute at the quality floor
    d = choose_codec(fast, 0.15, CTX, fast.cost_model)
    assert d.choice == "zstd-shuffle" and d.note is None
    unprofiled = dataclasses.replace(fast, codecs={})
    assert choose_codec(unprofiled, 0.15, CTX, fast.cost_model).options == []


def test_measure_codecs_times_every_codec_on_the_same_kv():
    g = torch.Generator().manual_seed(0)
    layers = [(torch.randn(3, 64, 64, generator=g).half(), torch.randn(3, 64, 64, generator=g).half())
              for _ in range(2)]
    sample = SampleKV([[encode_layer(k, v, "zstd-shuffle") for k, v in layers]], 64, "zstd-shuffle", "random")
    rates = measure_codecs(sample, level=3, seconds=0.01)
    assert set(rates) == set(CODECS)
    assert rates["int4"]["stored_fraction"] < rates["int8"]["stored_fraction"] < rates["zstd"]["stored_fraction"]
    assert all(r["decompress_MBps"] > 0 and r["decompress_raw_MBps"] > 0 for r in rates.values())
    restored = Profile.from_dict({**profile(0.01, 0.004).to_dict(), "codecs": rates})
    assert restored.codecs == rates
