"""aaflow operators package."""
