// tarlist: how Go's archive/tar (the reader behind `docker load`) reads a tar file: one line per
// entry, "<typeflag as a number> <size> <name>", then "END" or "ERROR <why>". Built and run by
// tests/test_relay_headers.py to compare the relay agent's header check against it.
package main

import (
	"archive/tar"
	"bufio"
	"fmt"
	"io"
	"os"
)

func main() {
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			fmt.Fprintln(out, "END")
			return
		}
		if err != nil {
			fmt.Fprintln(out, "ERROR", err)
			return
		}
		fmt.Fprintf(out, "%d %d %q\n", hdr.Typeflag, hdr.Size, hdr.Name)
	}
}
