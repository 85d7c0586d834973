"""The campaign report: Markdown with PNG charts, built only from pulled raw result files.

:mod:`.build` puts it together (scope line, the sections in order, the list of runs) from the sections of
:mod:`.speed`, :mod:`.quality` and :mod:`.serving`, written with :mod:`.markdown`'s pieces.
"""

from rigctl.analysis.report.build import Report, build_report, default_out_dir, plain

__all__ = ["Report", "build_report", "default_out_dir", "plain"]
