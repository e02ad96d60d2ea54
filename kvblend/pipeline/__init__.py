"""The pipeline: what the CLI and the Python API call.

engine.py     Engine: the resources plus ingest() and query()
ingest.py     documents → segments → prefilled alone → archived KV + embeddings
query.py      question → retrieve → assemble → stream + fuse → generate
resources.py  one archive + one (lazily loaded) model, and the key scheme they imply
results.py    QueryResult, IngestReport, SegmentInfo (the options are kvblend.options')
"""

from kvblend.pipeline.engine import Engine
from kvblend.pipeline.resources import Resources
from kvblend.pipeline.results import (
    IngestReport,
    QueryOptions,
    QueryResult,
    SegmentInfo,
)

__all__ = ["Engine", "IngestReport", "QueryOptions", "QueryResult", "Resources", "SegmentInfo"]
