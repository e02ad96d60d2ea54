"""Feeds hand the fusor each layer's cached KV, laid out for the whole prompt and re-positioned.

memory.py   InMemoryFeed over KV already in memory, and the layout step every feed shares
archive.py  ArchiveFeed: streams layers from the archive with bounded prefetch
"""
