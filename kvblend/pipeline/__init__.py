"""The pipeline: what the CLI and the Python API call.

    engine.py   Engine: one archive + one (lazily loaded) model; ingest() and query()
    ingest.py   documents → segments → prefilled alone → archived KV + embeddings
    query.py    question → retrieve → assemble → stream + fuse → generate
    results.py  QueryOptions, QueryResult, IngestReport, SegmentInfo
"""

from kvblend.pipeline.engine import Engine
from kvblend.pipeline.results import IngestReport, QueryOptions, QueryResult, SegmentInfo

__all__ = ["Engine", "IngestReport", "QueryOptions", "QueryResult", "SegmentInfo"]
