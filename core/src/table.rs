//! Plain aligned tables for the human output of `next`, `status` and `dlq list`.

/// Left-aligned columns, two spaces apart, widths from the widest cell (in characters),
/// trailing spaces trimmed; one line per row after the header line.
pub fn render<S: AsRef<str>>(headers: &[&str], rows: &[Vec<S>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.as_ref().chars().count());
        }
    }
    let mut out = line(headers, &widths);
    out.push('\n');
    for row in rows {
        out.push_str(&line(row, &widths));
        out.push('\n');
    }
    out
}

/// One line of a table whose columns are `widths` wide (no newline): each cell padded, two
/// spaces between, no trailing blanks. For a table written row by row, widths known first.
pub fn line<S: AsRef<str>>(cells: &[S], widths: &[usize]) -> String {
    let padded: Vec<String> = cells
        .iter()
        .zip(widths)
        .map(|(cell, w)| format!("{:<w$}", cell.as_ref()))
        .collect();
    padded.join("  ").trim_end().to_owned()
}

/// A long, possibly multi-line text (a run's error, a stderr tail) shown in one cell or line:
/// line breaks as ` ⏎ `, at most `max` characters, keeping its start (what failed) and its end
/// (the last words of a stderr) around a `…`. The `--json` outputs carry the text whole.
pub fn one_line(text: &str, max: usize) -> String {
    let flat = text.trim_end().replace('\n', " ⏎ ");
    let count = flat.chars().count();
    if count <= max {
        return flat;
    }
    let head = max / 3;
    let tail = max.saturating_sub(head + 1);
    let start: String = flat.chars().take(head).collect();
    let end: String = flat.chars().skip(count - tail).collect();
    format!("{start}…{end}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_fit_on_one_line_with_both_ends() {
        assert_eq!(one_line("exit code 1\n", 80), "exit code 1");
        assert_eq!(one_line("a\nb", 80), "a ⏎ b");
        let long = format!("exit code 1: stderr: {}the end", "x".repeat(500));
        let cut = one_line(&long, 30);
        assert_eq!(cut.chars().count(), 30);
        assert!(
            cut.starts_with("exit code ") && cut.ends_with("xthe end"),
            "{cut}"
        );
    }

    #[test]
    fn aligns_columns_and_trims_line_ends() {
        let rows = vec![vec!["a", "bbbb", ""], vec!["ccc", "d", "é"]];
        assert_eq!(
            render(&["X", "Y", "Z"], &rows),
            "X    Y     Z\na    bbbb\nccc  d     é\n"
        );
    }
}
