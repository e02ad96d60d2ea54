"""The loading controller (design §2, paper §5.1): measure the machine, pick the ratio and the storage.

* :mod:`~kvblend.archive.records`: names under which profiles and tuned settings are stored (no torch).
* :mod:`~kvblend.tuning.delay`: the delay model, ``r = max(r_quality, r_hide)``, the quality floor.
* :mod:`~kvblend.tuning.storage`: the cheapest storage whose loading hides recompute.
* :mod:`~kvblend.machine`: which machine measured what; the one machine description.
* :mod:`~kvblend.tuning.profile`: :class:`Profile`, what `kvblend profile` stores, and which apply here.
* :mod:`~kvblend.tuning.profiling`, :mod:`~kvblend.tuning.probes`, :mod:`~kvblend.tuning.sample`:
  measuring a profile (storage read, codec, per-layer prefill).
* :mod:`~kvblend.tuning.quality`: the bundled calibration set and the quality sweep behind ``r_quality``.
* :mod:`~kvblend.tuning.tune`: :class:`TunedSetting` and :func:`run_tune`, what `kvblend tune` does.
* :mod:`~kvblend.tuning.jsonable`: the version check both stored records share.

Nothing is imported here, so ``import kvblend.archive.records`` stays free of torch.
"""
