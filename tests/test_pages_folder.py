"""Why the Streamlit pages live in app_pages/, not pages/ (docs/architecture.md)."""

from streamlit.runtime.pages_manager import PagesManager


def test_pinned_streamlit_still_auto_registers_a_pages_folder(tmp_path, monkeypatch):
    """With a `pages/` folder beside the entry script, Streamlit runs the first script run as a v1
    multipage app (every pages/*.py becomes a page, common.py included) before st.navigation turns that
    off. If this test fails, a newer Streamlit dropped that: the pages can move to pages/."""
    (tmp_path / "pages").mkdir()
    (tmp_path / "app.py").write_text("")
    monkeypatch.setattr(PagesManager, "uses_pages_directory", None)
    PagesManager(str(tmp_path / "app.py"))
    assert PagesManager.uses_pages_directory is True
