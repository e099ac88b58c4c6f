"""Fire drills: a deadline the job saves for and trains through (docs/drill.md)."""
