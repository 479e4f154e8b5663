"""Streamlit pages of the kvdemo app (layout only) and their shared helpers (`common`)."""
