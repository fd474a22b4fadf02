"""The matrix flow: plan, references (the content-keyed reference cache), one launch per cell, checks, results."""
