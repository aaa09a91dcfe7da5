"""`gpufeed doctor`: where does a data pipeline spend its time, and what to do about it."""

from gpufeed.doctor.doctor import diagnose

__all__ = ["diagnose"]
