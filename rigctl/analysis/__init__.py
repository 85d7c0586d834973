"""What the pulled runs say: paired comparisons, the campaign report, runtime checks."""
