"""The chat: messages rendered as Markdown, the composer, the conversation list, and the controller."""
