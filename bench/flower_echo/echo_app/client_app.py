"""ClientApp: reply at once with the bytes received."""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

app = ClientApp()


@app.query()
def echo(msg: Message, context: Context) -> Message:
    return Message(msg.content, reply_to=msg)
