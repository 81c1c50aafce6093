"""The live panels beside the chat: each a QWidget fed protocol events, repainted at the frame rate."""
