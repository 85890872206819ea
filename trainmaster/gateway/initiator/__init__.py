"""The task initiator: task files, the client, and the download of streamed results."""
