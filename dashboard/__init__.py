"""The Streamlit dashboard over the results database (read-only): `tuner dashboard` runs app.py."""
