"""What a request asks for: the sampling settings, declared once, and their parsing for every protocol."""
