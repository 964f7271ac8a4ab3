"""The dashboard's pages: each file is a Streamlit page script (run by st.navigation, see
dashboard/nav.py) and a module whose `render(ctx)` draws it."""
