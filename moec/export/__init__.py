"""Exporting trained moec programs to other ecosystems' formats.

``moec.export.export_hf(run_or_checkpoint, out, model=... | config=...)`` writes a transformers
MoE model (:mod:`moec.export.hf`); ``moec export`` is its command line
(:mod:`moec.export.cli`).
"""

from moec.export.cli import add_export_parser, cmd_export
from moec.export.hf import ExportError, ExportResult, export_hf

__all__ = ["ExportError", "ExportResult", "add_export_parser", "cmd_export", "export_hf"]
