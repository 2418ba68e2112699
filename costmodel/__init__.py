"""aaflow costmodel package."""
