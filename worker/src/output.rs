//! A shell task's output (docs/design.md#failures-you-can-read): its stderr is read by the
//! worker, which keeps the last [`STDERR_KEPT`] bytes for the run's outcome (the run history,
//! the dead letter's `x-drumline-error`) and passes the output on. With `--log-format json`
//! ([`output_as_events`]) each line of stdout and stderr becomes a JSON log event with the
//! fields `key`, `task`, `stream` and `line`, instead of raw text mixed into the log; otherwise
//! stderr is copied to the worker's stderr as it comes and stdout is the worker's own.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::io::{AsyncRead, AsyncReadExt};

/// How much of a failed shell task's stderr is kept with its outcome: the end of it.
pub const STDERR_KEPT: usize = 4096;

/// The longest line emitted as one event; a longer one is cut into several.
const LINE_MAX: usize = 16 * 1024;

static AS_EVENTS: AtomicBool = AtomicBool::new(false);

/// Makes every shell task's output lines JSON log events (`drumline-worker --log-format
/// json` turns it on; off by default). Set before the first task runs.
pub fn output_as_events(on: bool) {
    AS_EVENTS.store(on, Ordering::Relaxed);
}

/// Whether task output becomes log events ([`output_as_events`]).
pub fn as_events() -> bool {
    AS_EVENTS.load(Ordering::Relaxed)
}

/// Which of a task's output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

impl Stream {
    /// `stdout` or `stderr`: the `stream` field of an event.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// The last `cap` bytes written to it.
#[derive(Debug, Clone)]
pub struct Tail {
    cap: usize,
    bytes: VecDeque<u8>,
}

impl Tail {
    /// An empty tail keeping at most `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            cap,
            bytes: VecDeque::with_capacity(cap.min(STDERR_KEPT)),
        }
    }

    /// Appends `chunk`, dropping what falls out of the window.
    pub fn push(&mut self, chunk: &[u8]) {
        let chunk = &chunk[chunk.len().saturating_sub(self.cap)..];
        let over = (self.bytes.len() + chunk.len()).saturating_sub(self.cap);
        self.bytes.drain(..over);
        self.bytes.extend(chunk);
    }

    /// The kept text (invalid UTF-8, such as a character cut at the window's start, replaced),
    /// trailing white space removed.
    pub fn text(&self) -> String {
        let (a, b) = self.bytes.as_slices();
        let text = String::from_utf8_lossy(&[a, b].concat()).into_owned();
        text.trim_end().to_owned()
    }
}

/// Splits a stream into lines of at most `LINE_MAX` bytes (without the `\n`).
#[derive(Debug, Default)]
pub struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// Feeds `chunk`; calls `line` for each line it completes.
    pub fn feed(&mut self, chunk: &[u8], mut line: impl FnMut(&[u8])) {
        for &b in chunk {
            if b == b'\n' {
                line(&self.partial);
                self.partial.clear();
            } else {
                self.partial.push(b);
                if self.partial.len() >= LINE_MAX {
                    line(&self.partial);
                    self.partial.clear();
                }
            }
        }
    }

    /// The unterminated last line, if any.
    pub fn finish(self, mut line: impl FnMut(&[u8])) {
        if !self.partial.is_empty() {
            line(&self.partial);
        }
    }
}

/// Reads `stream` of the run `key` of `task` to its end, passing it on (events or raw, see
/// the module doc); returns its last [`STDERR_KEPT`] bytes.
pub async fn drain(
    mut reader: impl AsyncRead + Unpin,
    stream: Stream,
    key: String,
    task: String,
) -> Tail {
    let events = as_events();
    let mut tail = Tail::new(STDERR_KEPT);
    let mut lines = Lines::default();
    let emit = |line: &[u8]| {
        let line = String::from_utf8_lossy(line);
        tracing::info!(target: "drumline::task", key = %key, task = %task, stream = stream.as_str(), line = %line, "task output");
    };
    let mut buf = vec![0u8; 8192];
    let mut last = None;
    loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let chunk = &buf[..n];
        tail.push(chunk);
        last = chunk.last().copied();
        if events {
            lines.feed(chunk, emit);
        } else {
            pass_on(stream, chunk);
        }
    }
    if events {
        lines.finish(emit);
    } else if unterminated(last) {
        // Output that does not end its last line would be glued to the next log line.
        pass_on(stream, b"\n");
    }
    tail
}

/// Copies raw output to the worker's stream of the same kind, best effort (as an inherited
/// stream was).
fn pass_on(stream: Stream, bytes: &[u8]) {
    let _ = match stream {
        Stream::Stderr => std::io::stderr().write_all(bytes),
        Stream::Stdout => std::io::stdout().write_all(bytes),
    };
}

/// Whether output whose last byte was `last` (none: no output) leaves its last line open.
fn unterminated(last: Option<u8>) -> bool {
    last.is_some_and(|b| b != b'\n')
}

/// A failed shell task's stderr, kept as the cause of its error.
#[derive(Debug, thiserror::Error)]
#[error("stderr: {0}")]
pub struct Stderr(pub String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_output_that_ends_mid_line_is_closed() {
        assert!(unterminated(Some(b'x')));
        assert!(!unterminated(Some(b'\n')) && !unterminated(None));
    }

    #[test]
    fn the_tail_keeps_the_last_bytes() {
        let mut tail = Tail::new(8);
        tail.push(b"abc");
        tail.push(b"defgh");
        assert_eq!(tail.text(), "abcdefgh");
        tail.push(b"ij\n");
        assert_eq!(tail.text(), "defghij");
        tail.push(b"0123456789ABCDEF");
        assert_eq!(tail.text(), "89ABCDEF");
        // A character cut at the window's start is replaced, not an error.
        let mut cut = Tail::new(2);
        cut.push("é!".as_bytes());
        assert_eq!(cut.text(), "\u{FFFD}!");
    }

    #[test]
    fn lines_are_split_at_newlines_and_at_the_size_limit() {
        let mut lines = Lines::default();
        let mut out: Vec<String> = Vec::new();
        let mut push = |l: &[u8]| out.push(String::from_utf8_lossy(l).into_owned());
        lines.feed(b"one\ntw", &mut push);
        lines.feed(b"o\n\nthree", &mut push);
        lines.finish(&mut push);
        assert_eq!(out, ["one", "two", "", "three"]);
        let mut long = Vec::new();
        let mut lines = Lines::default();
        lines.feed(&vec![b'x'; LINE_MAX + 1], |l| long.push(l.len()));
        lines.finish(|l| long.push(l.len()));
        assert_eq!(long, [LINE_MAX, 1]);
    }
}
