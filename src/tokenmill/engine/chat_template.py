"""Old home of tokenmill.chat_template, re-exported while the parallel issue-13 branches that import
this path merge; import from tokenmill.chat_template (model code may not import engine)."""

from tokenmill.chat_template import load_chat_template, render_chat

__all__ = ["load_chat_template", "render_chat"]
