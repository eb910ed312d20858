"""Foundational primitives every part of merak may use.

The modules here import nothing else from merak, so any package can depend on
them without depending on another package's internals:

- :mod:`merak.core.names`: module-name globs (``transformer.h.*.attn``);
- :mod:`merak.core.slices`: which piece of a full tensor a tensor-parallel
  rank holds, and which parameters have gradients that are partial sums;
- :mod:`merak.core.group_registry`: the named tensor-parallel groups the
  collective operators run on;
- :mod:`merak.core.plan_sources`: where model libraries' adapters register
  default tensor-parallel plans;
- :mod:`merak.core.fields`: ``setting()``, a config field's default, meaning and
  range, and the type and range checks every settings section uses;
- :mod:`merak.core.partition`: which consecutive items each pipeline stage holds;
- :mod:`merak.core.files`: atomic text and JSON writes.
"""
