"""
The chat page (serve.html) in a real headless browser: Debian's chromium and
chromium-driver, driven by Selenium (given the driver's path: it cannot download one
offline). A question typed and sent with Enter gets the streamed greedy reply, which is
chat's reply to the same questions (two turns); a reply shows as it streams, Stop
stops the server's generation, New chat starts over, an error is shown as its sentence.
Skips without a browser, except under CI=true or NANOEULER_CI=1 (.ci/run installs one), where it fails.

    python -m pytest -q test_serve_browser.py
    NANOEULER_SCREENSHOT=docs/serve.png NANOEULER_SCREENSHOT_MODEL=out/sft/best.safetensors \
        python -m pytest -q test_serve_browser.py -k greedy          # docs/serve.md's picture
"""

import nanoeuler as ne  # noqa: F401  first: it sets the BLAS thread count before numpy loads

import os
import shutil

import pytest

from test_serve import WAIT, Gate, chat_transcript, model, needs, on_ci, running, wait_for  # noqa: F401  (model: a fixture)

# what Chromium needs on these machines: no sandbox as root, no GPU, and none of its own
# connections to Google's hosts (the network is closed: they fail, many at a time)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1000,720"]


@pytest.fixture
def browser(tmp_path, monkeypatch):
    webdriver = needs("selenium.webdriver")
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        missing = "chromium" if not chromium else "chromedriver"
        if on_ci():
            pytest.fail(f"{missing} is not installed; .ci/run installs chromium and chromium-driver")
        pytest.skip(f"{missing} is not installed (apt-get install chromium chromium-driver)")
    monkeypatch.setenv("SE_OFFLINE", "true")               # Selenium Manager: look for nothing online
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS + [f"--user-data-dir={tmp_path / 'profile'}"]:
        options.add_argument(flag)
    b = webdriver.Chrome(service=webdriver.ChromeService(executable_path=driver), options=options)
    try:
        yield b
    finally:
        b.quit()


def until(b, condition, what):
    """wait (the browser's own wait: no sleeps) until condition(b) is true"""
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(b, WAIT).until(condition, f"waited {WAIT} s for {what}")


REPLIES = """return [...document.querySelectorAll('.msg.assistant')].map(div =>
    [[...div.childNodes].filter(n => n.nodeType === 3).map(n => n.textContent).join(''), div.dataset.done || null])"""


def send(b, question):
    from selenium.webdriver.common.keys import Keys
    box = b.find_element("id", "prompt")
    box.send_keys(question)
    box.send_keys(Keys.ENTER)


def settings(b, temperature, max_tokens):
    b.execute_script("document.getElementById('temperature').value = arguments[0];"
                     "document.getElementById('max-tokens').value = arguments[1];", str(temperature), str(max_tokens))


def test_a_typed_question_gets_the_streamed_greedy_reply(model, browser, monkeypatch, capsys, tmp_path):
    path = os.environ.get("NANOEULER_SCREENSHOT_MODEL") or model
    questions = ["Hello there", "What is the best way to learn a new language?"]
    max_tokens = 40
    want = chat_transcript(path, questions, max_tokens, monkeypatch, capsys)
    with running(path) as srv:
        browser.get(srv.url)
        until(browser, lambda b: b.find_element("id", "model").text == os.path.basename(path), "the model's name")
        settings(browser, 0, max_tokens)
        for i, question in enumerate(questions):
            send(browser, question)
            until(browser, lambda b: len([r for r in b.execute_script(REPLIES) if r[1]]) == i + 1 and
                  b.execute_script("return document.body.dataset.state") == "idle", f"reply {i + 1}")
        replies = browser.execute_script(REPLIES)
        assert [text for text, _ in replies] == want
        assert [m.text for m in browser.find_elements("css selector", ".msg.user")] == questions
        shot = os.environ.get("NANOEULER_SCREENSHOT") or str(tmp_path / "serve.png")
        assert browser.save_screenshot(shot)
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_reply_shows_as_it_streams_and_stop_stops_the_generation(model, browser):
    gate = Gate(n=1000)
    with running(model, gate, poll_seconds=0.05) as srv:
        browser.get(srv.url)
        send(browser, "Tell me everything")
        # the first piece is on the page while the server still waits to generate the second
        until(browser, lambda b: b.execute_script(REPLIES) == [["a", None]], "the first piece of the reply")
        assert browser.execute_script("return document.body.dataset.state") == "generating"
        browser.find_element("id", "stop").click()
        wait_for(srv, lambda: srv.model.left == 1)        # the server saw the page go
        gate.open()
        wait_for(srv, lambda: srv.model.finished == [("gone", 1)])
        until(browser, lambda b: b.execute_script(REPLIES) == [["a", "stopped"]], "the stopped reply")
        assert "(stopped)" in browser.find_element("css selector", ".msg.assistant").text
        browser.find_element("id", "reset").click()            # New chat: the conversation is gone
        assert browser.execute_script(REPLIES) == [] and browser.find_elements("css selector", ".msg") == []


def test_a_refused_request_shows_its_sentence(model, browser):
    with running(model, Gate(n=1)) as srv:
        browser.get(srv.url)
        settings(browser, 0, 5000)                             # over the limit of 4,096
        send(browser, "Hello")
        error = until(browser, lambda b: b.find_elements("css selector", ".msg.error"), "the error")[0]
        assert "max_tokens must be an integer from 1 to 4096, not 5000" in error.text
        assert browser.execute_script(REPLIES) == []
        settings(browser, 0, 5)                                # the question can be asked again
        send(browser, "Hello")
        until(browser, lambda b: b.execute_script(REPLIES) == [["a", "stop"]], "the reply")
