"""Exporting trained moec programs to other ecosystems' formats.

``moec.export.export_hf(run_or_checkpoint, out, model=... | config=...)`` writes a transformers
MoE model (:mod:`moec.export.hf`); ``moec export`` is its command line
(:mod:`moec.export.cli`). The names below are imported on first use (:mod:`moec.lazy`).
"""

from moec.lazy import lazy_exports

DTYPE_NAMES = ("float32", "bfloat16", "float16")
"""The torch dtypes ``moec export --dtype`` names (:data:`moec.export.hf.DTYPES`), here so that
the command's parser imports no torch."""

__all__ = ["ExportError", "ExportResult", "add_export_parser", "cmd_export", "export_hf"]

__getattr__, __dir__ = lazy_exports(
    globals(),
    {
        **dict.fromkeys(("add_export_parser", "cmd_export"), "moec.export.cli"),
        **dict.fromkeys(("ExportError", "ExportResult", "export_hf"), "moec.export.hf"),
    },
)
