"""aaflow cluster package."""
