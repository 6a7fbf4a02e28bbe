//! Cutting a config with many `[[jobs]]` into pieces that parse one at a time, so loading a
//! 100,000-job file never holds the whole document's tokens and tables at once (the `toml`
//! crate builds both for the whole text before deserialising: about 270 MB for an 8 MiB file).
//!
//! The cut follows the file's tokens (`toml_parser`'s lexer, so strings, multi-line strings and
//! comments are never mistaken for headers) and only ever cuts before a table header at the
//! start of a line, outside any array or inline table. The jobs region runs from the first
//! `[[jobs]]` header over every header that is `[[jobs]]` or starts with `[jobs.` / `[[jobs.`
//! (each of those belongs to the job above it, in the whole file as in a piece). The rest of
//! the file — what comes before and after the region — is one more piece.
//!
//! A piece parsed alone means what it means in the file, with one gap the caller closes: the
//! rest must not mention `jobs` at all (it would conflict with the region in the whole file).
//! Anything unusual returns `None`, and the caller parses the whole file the ordinary way;
//! so does any piece that fails to parse, so every error is the one the whole file gives.

use toml_parser::lexer::TokenKind;
use toml_parser::Source;

/// The pieces of a file.
pub(super) struct Cut<'a> {
    /// Everything outside the jobs region, in file order.
    pub rest: String,
    /// The jobs region, cut before every `per_piece`-th `[[jobs]]` header.
    pub jobs: Vec<&'a str>,
}

/// What a header line is, for the cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Header {
    /// Exactly `[[jobs]]`: a new job.
    Job,
    /// `[jobs.…]` or `[[jobs.…]]`: a table of the job above.
    OfJob,
    /// Any other table.
    Other,
}

fn header_kind(text: &str) -> Header {
    if text == "[[jobs]]" {
        Header::Job
    } else if text.starts_with("[jobs.") || text.starts_with("[[jobs.") {
        Header::OfJob
    } else {
        Header::Other
    }
}

/// Cuts `text` (see the module doc); `None` when the file has no `[[jobs]]` region or anything
/// about its shape is unusual.
pub(super) fn cut(text: &str, per_piece: usize) -> Option<Cut<'_>> {
    let headers = headers(text)?;
    let first = headers.iter().position(|(_, h)| *h == Header::Job)?;
    let end = headers[first..]
        .iter()
        .position(|(_, h)| *h == Header::Other)
        .map_or(headers.len(), |n| first + n);
    // Jobs outside one contiguous region: the whole file decides.
    if headers[..first]
        .iter()
        .chain(&headers[end..])
        .any(|(_, h)| *h != Header::Other)
    {
        return None;
    }
    let region_end = headers.get(end).map_or(text.len(), |(at, _)| *at);
    let region_start = headers[first].0;
    let mut jobs = Vec::new();
    let mut piece_start = region_start;
    let mut in_piece = 0;
    for (at, kind) in &headers[first..end] {
        if *kind == Header::Job {
            if in_piece == per_piece.max(1) {
                jobs.push(text.get(piece_start..*at)?);
                piece_start = *at;
                in_piece = 0;
            }
            in_piece += 1;
        }
    }
    jobs.push(text.get(piece_start..region_end)?);
    let mut rest = String::with_capacity(region_start + text.len() - region_end);
    rest.push_str(text.get(..region_start)?);
    rest.push_str(text.get(region_end..)?);
    Some(Cut { rest, jobs })
}

/// Every table header of `text` at depth 0, at the start of a line: (offset, kind), read from
/// the file's tokens. `None` when the brackets do not balance.
fn headers(text: &str) -> Option<Vec<(usize, Header)>> {
    let mut headers: Vec<(usize, Header)> = Vec::new();
    let mut depth: usize = 0;
    let mut line_start = true;
    let mut tokens = Source::new(text).lex();
    while let Some(token) = tokens.next() {
        let span = token.span();
        match token.kind() {
            TokenKind::Whitespace | TokenKind::Comment => {}
            TokenKind::Newline => line_start = true,
            TokenKind::Eof => break,
            TokenKind::LeftSquareBracket if depth == 0 && line_start => {
                // A header: up to the end of its line.
                let start = span.start();
                let mut end = span.end();
                for token in tokens.by_ref() {
                    match token.kind() {
                        TokenKind::Newline | TokenKind::Eof => break,
                        TokenKind::Whitespace | TokenKind::Comment => {}
                        _ => end = token.span().end(),
                    }
                }
                headers.push((start, header_kind(text.get(start..end)?)));
                line_start = true;
            }
            TokenKind::LeftSquareBracket | TokenKind::LeftCurlyBracket => {
                depth += 1;
                line_start = false;
            }
            TokenKind::RightSquareBracket | TokenKind::RightCurlyBracket => {
                depth = depth.checked_sub(1)?;
                line_start = false;
            }
            _ => line_start = false,
        }
    }
    (depth == 0).then_some(headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(text: &str, per: usize) -> Option<(String, Vec<&str>)> {
        cut(text, per).map(|c| (c.rest, c.jobs))
    }

    #[test]
    fn the_jobs_region_is_cut_before_every_nth_job_and_the_rest_kept_in_order() {
        let text = "namespace = \"n\"\n[beat]\nx = 1\n\
                    [[jobs]]\nname = \"a\"\n[jobs.args]\nk = [\n[1],\n]\n\
                    [[jobs]]\nname = \"b\"\n\
                    [[jobs]]\nname = \"c\"\n\
                    [tasks.t]\ncommand = [\"/bin/true\"]\n";
        let (rest, jobs) = pieces(text, 2).unwrap();
        assert_eq!(
            rest,
            "namespace = \"n\"\n[beat]\nx = 1\n[tasks.t]\ncommand = [\"/bin/true\"]\n"
        );
        assert_eq!(
            jobs,
            vec![
                "[[jobs]]\nname = \"a\"\n[jobs.args]\nk = [\n[1],\n]\n[[jobs]]\nname = \"b\"\n",
                "[[jobs]]\nname = \"c\"\n",
            ]
        );
    }

    #[test]
    fn headers_inside_strings_arrays_and_comments_are_not_cut_at() {
        let text = "a = \"\"\"\n[[jobs]]\n\"\"\"\nb = [\n  [[1]],\n]\n# [[jobs]]\n\
                    [[jobs]]\nname = 'x'\nargs = { s = '''\n[other]\n''' }\n[x]\n";
        let (rest, jobs) = pieces(text, 10).unwrap();
        assert_eq!(
            rest,
            "a = \"\"\"\n[[jobs]]\n\"\"\"\nb = [\n  [[1]],\n]\n# [[jobs]]\n[x]\n"
        );
        assert_eq!(
            jobs,
            vec!["[[jobs]]\nname = 'x'\nargs = { s = '''\n[other]\n''' }\n"]
        );
    }

    #[test]
    fn unusual_shapes_are_left_to_the_whole_file() {
        // No jobs; jobs in two places; a table of jobs outside the region; unbalanced.
        assert!(pieces("a = 1\n[x]\n", 2).is_none());
        assert!(pieces("[[jobs]]\nname = 'a'\n[x]\n[[jobs]]\nname = 'b'\n", 2).is_none());
        assert!(pieces("[jobs.args]\n[[jobs]]\nname = 'a'\n", 2).is_none());
        assert!(pieces("[x]\n[jobs.args]\n", 2).is_none());
        assert!(pieces("a = [\n[[jobs]]\n", 2).is_none());
        assert!(pieces("a = ]\n[[jobs]]\n", 2).is_none());
    }
}
