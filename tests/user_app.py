"""A user's own server module, as the source tests write into a project folder: ``make_server()``
serves UPPER and BOOM (its handler raises with a secret in the text); the other names are bad
``--app`` targets."""

APP = '''
from evergreen_trio import ActionContext, Server

def make_server() -> Server:
    server = Server()

    @server.action("UPPER", inputs=["input"], outputs=["output"])
    async def upper(ctx: ActionContext) -> None:
        await ctx.output("output").write((await ctx.input("input").read_text()).upper(), last=True)

    @server.action("BOOM", inputs=["input"], outputs=["output"])
    async def boom(ctx: ActionContext) -> None:
        raise ValueError("db password is hunter2")

    return server

server = make_server()
NOT_A_SERVER = 42

def raising() -> Server:
    raise RuntimeError("no config file")

async def async_factory() -> Server:
    return Server()
'''
