"""One FastAPI router per endpoint family."""
