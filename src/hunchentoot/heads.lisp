;;;; heads.lisp -- Hunchentoot's requests read from Gallop's request record,
;;;; and its response heads written by Gallop's writer.
;;;;
;;;; Hunchentoot reads a request head through its stream a character at a
;;;; time (chunga's READ-LINE*, then CL-PPCRE:SPLIT of the request line) and
;;;; writes a response head through a fresh flexi-stream with FORMAT, one
;;;; generic call per character.  On a Gallop connection the head was already
;;;; read and checked once (gallop.core's PARSE-HEAD), and the connection has
;;;; an output buffer of octets: so here
;;;;  - READ-REQUEST-DATA, which Gallop's request loop (request-loop.lisp)
;;;;    reads each head with, answers from the connection's request record
;;;;    (the same four values Hunchentoot's GET-REQUEST-DATA computes:
;;;;    headers alist, method, URI, protocol), and the head is consumed
;;;;    without being read again;
;;;;  - SEND-RESPONSE, Hunchentoot's internal function (see compat.lisp),
;;;;    which its START-OUTPUT calls, is wrapped with SB-INT:ENCAPSULATE: on
;;;;    a Gallop connection it writes the status line and header lines
;;;;    straight into the connection's output buffer.
;;;; On any other stream, and whenever HUNCHENTOOT:*HEADER-STREAM* is set (it
;;;; asks for a copy of every head line), Hunchentoot's own functions run.
;;;; Everything around them -- PROCESS-REQUEST, the request object,
;;;; handlers, sessions, START-OUTPUT -- is Hunchentoot's, unchanged.
;;;;
;;;; Where the result differs from Hunchentoot's own, on purpose:
;;;;  - Header names a client sends and no code in the image names become
;;;;    uninterned symbols, not new keywords (as the native API does with
;;;;    methods), so that clients cannot grow the KEYWORD package.  A handler
;;;;    that names a header (HEADER-IN* :X-MINE) finds it: naming it interned it.
;;;;  - The method is the core's reading of it, case-sensitive as RFC 9110 9.1
;;;;    says: "get" is not :GET (Hunchentoot upper-cases it; a "head" it
;;;;    answered without a body is a response a proxy in front frames
;;;;    differently).  On 1.3.x, which serves nine methods, the engine answers
;;;;    any other, "get" included, 501 first (compat.lisp).
;;;;  - An HTTP/1.0 request with Expect: 100-continue gets no 100 Continue
;;;;    (RFC 9110 10.1.1, 15.2: no 1xx to an HTTP/1.0 client).
;;;;  - A header value neither string nor number is written as PRINC writes
;;;;    it (Hunchentoot's default method): a method of one's own on
;;;;    Hunchentoot's internal WRITE-HEADER-LINE is not called.
;;;;  - A header value with newlines is written as one line, the lines joined
;;;;    by a space (what a client makes of Hunchentoot's obsolete line folding,
;;;;    which RFC 9112 5.2 forbids in responses); an empty value gets its
;;;;    CRLF (Hunchentoot's writer omits it, merging the next line into it);
;;;;    CR and other controls become spaces, characters beyond Latin-1 "?".

(in-package #:gallop)

;;; Reading: GET-REQUEST-DATA from the record

(defun header-keyword (buffer start end)
  "The symbol Hunchentoot's headers alist names the header BUFFER[START,END)
by: the keyword of its upper-case name when one exists (every name some code
mentions), else an uninterned symbol of that name."
  (declare (type octets buffer) (type fixnum start end))
  (macrolet ((match-common ()
               `(gallop.core:octets-case (buffer start end :ignore-case t)
                  ;; the native API's common names (src/native/request.lisp)
                  ,@(loop for name in +common-header-names+
                          collect `(,name ,(intern (string-upcase name) :keyword)))
                  (t (let ((name (make-string (- end start))))
                       (loop for i of-type fixnum from start below end
                             for j of-type fixnum from 0
                             do (setf (schar name j) (char-upcase (code-char (aref buffer i)))))
                       (multiple-value-bind (symbol status) (find-symbol name :keyword)
                         (if status symbol (make-symbol name))))))))
    (match-common)))

(defun request-headers-alist (buffer request)
  "The header fields of REQUEST as Hunchentoot's (chunga's READ-HTTP-HEADERS)
alist: (NAME . VALUE) in the order of the head, a repeated name once, its
values joined by a comma."
  (let ((headers '())
        (uninterned nil))
    (gallop.core:do-request-fields (name-start name-end value-start value-end) request
      (let* ((name (let ((symbol (header-keyword buffer name-start name-end)))
                     (if (symbol-package symbol)
                         symbol
                         ;; One symbol per name in a request, so that a
                         ;; repeated name is found by EQ like a keyword.
                         (let ((table (or uninterned
                                          (setf uninterned (make-hash-table :test 'equal)))))
                           (or (gethash (symbol-name symbol) table)
                               (setf (gethash (symbol-name symbol) table) symbol))))))
             (value (latin1-string buffer value-start value-end))
             (old (and headers (assoc name headers :test #'eq))))
        (if old
            (setf (cdr old) (concatenate 'string (cdr old) "," value))
            (push (cons name value) headers))))
    (nreverse headers)))

(defun read-request-data (original stream)
  "What Hunchentoot's GET-REQUEST-DATA gives for STREAM (see the file's
header): from STREAM's request record when STREAM is a Gallop connection
with a checked head not read yet, else through ORIGINAL, Hunchentoot's own."
  (if (and (typep stream 'gallop.core:connection) (null hunchentoot:*header-stream*))
      (let ((request (cond ((connection-deferred stream)
                            :eof  ; no next request before its answer (defer.lisp)
                            )
                           ((gallop.core:connection-switched-p stream)
                            ;; After a 101 (SWITCH-PROTOCOLS) the connection
                            ;; speaks another protocol: no more requests.
                            :eof)
                           (t (gallop.core:connection-take-head stream)))))
        (case request
          ((nil) (funcall original stream))
          (:eof nil)
          (t
           (let ((buffer (gallop.core:connection-head stream)))
             (when (gallop.core:request-expect-continue request)
               ;; As Hunchentoot: the interim answer before the handler runs.
               (gallop.core:connection-write-continue stream))
             (values (request-headers-alist buffer request)
                     (gallop.core:request-method request)
                     (latin1-string buffer (gallop.core:request-target-start request)
                                    (gallop.core:request-target-end request))
                     (if (zerop (gallop.core:request-minor request)) :http/1.0 :http/1.1))))))
      (funcall original stream)))

;;; Writing: SEND-RESPONSE's head through the connection's buffer

(defvar *status-lines* (make-array 600 :initial-element nil)
  "The status line of each code below 600, as Hunchentoot writes it (its own
reason phrase), encoded once on first use (threads racing to fill an entry
store equal vectors).  A later change to Hunchentoot's table of reason
phrases is not seen.")

(defun hunchentoot-status-line (code)
  "The octets of the status line \"HTTP/1.1 CODE REASON\" CRLF."
  (flet ((make-line ()
           (map 'octets (lambda (char) (logand #xff (char-code char)))
                (format nil "HTTP/1.1 ~D ~A~C~C" code (hunchentoot:reason-phrase code)
                        #\Return #\Linefeed))))
    (if (typep code '(integer 0 599))
        (or (svref *status-lines* code)
            (setf (svref *status-lines* code) (make-line)))
        (make-line))))

(defun newline-p (string)
  "True when STRING holds a newline, by a loop typed for each kind of
string: FIND on a string of unknown kind takes the generic sequence path,
a call per character, on every header value of every answer."
  (declare (type string string))
  (macrolet ((scan (type)
               `(let ((string string))
                  (declare (type ,type string) (optimize speed (safety 0)))
                  (dotimes (i (length string) nil)
                    (when (char= #\Newline (char string i))
                      (return t))))))
    (typecase string
      ((simple-array character (*)) (scan (simple-array character (*))))
      (simple-base-string (scan simple-base-string))
      (t (scan string)))))

(defun one-line-value (value)
  "VALUE, a header value string, on one line: its lines (Hunchentoot writes
one per line, folded) joined by a space, empty ones dropped."
  (if (not (newline-p value))
      value
      (let ((lines (loop with start = 0
                         for end = (or (position #\Newline value :start start) (length value))
                         when (< start end) collect (subseq value start end)
                         while (< end (length value))
                         do (setf start (1+ end)))))
        (format nil "~{~A~^ ~}" lines))))

(defun write-header (c name value)
  "Write the header line NAME: VALUE on C.  VALUE is a string (see
ONE-LINE-VALUE) or a non-negative fixnum, written in decimal without the
printer (the Content-Length of every answer): the digits Hunchentoot's
WRITE-TO-STRING with :BASE 10 writes, but never the trailing dot a true
*PRINT-RADIX* would add."
  (declare (type string name) (type (or string (and fixnum unsigned-byte)) value))
  (let* ((value (if (stringp value) (one-line-value value) value))
         (n (+ (length name) 4 (if (stringp value) (length value) 19))))
    (multiple-value-bind (buffer fill) (gallop.core:connection-reserve-output c n)
      (if buffer
          (let ((fill (gallop.core:put-latin1 buffer fill name)))
            (declare (type octets buffer) (type fixnum fill))
            (setf (aref buffer fill) 58 (aref buffer (1+ fill)) 32)
            (setf fill (if (stringp value)
                           (gallop.core:put-latin1 buffer (+ fill 2) value)
                           (gallop.core:put-decimal buffer (+ fill 2) value)))
            (setf (aref buffer fill) 13 (aref buffer (1+ fill)) 10)
            (gallop.core:connection-commit-output c (+ fill 2)))
          (progn
            (gallop.core:connection-write-latin1 c name)
            (gallop.core:connection-write-latin1 c ": ")
            (if (stringp value)
                (gallop.core:connection-write-latin1 c value)
                (gallop.core:connection-write-decimal c value))
            ;; As octets: CONNECTION-WRITE-LATIN1 makes controls spaces.
            (gallop.core:connection-write-octets c gallop.core:+crlf-octets+))))))

(defun header-value-string (value)
  "VALUE as Hunchentoot's WRITE-HEADER-LINE writes it: a string as it is, a
number in decimal, anything else as PRINC writes it."
  (typecase value
    (string value)
    (number (write-to-string value :escape nil :readably nil :base 10))
    (t (princ-to-string value))))

(defun answer-closes-p (acceptor c)
  "True when the answer to the request on the Gallop connection C of
ACCEPTOR must end its connection: the server is stopping (HUNCHENTOOT:STOP
began, or the engine's stop), or the request's framing leaves nothing to
read after it (CONNECTION-CLOSE-AFTER-P)."
  (or (not (gallop.core:engine-running-p (gallop.core:connection-engine c)))
      ;; HUNCHENTOOT:STOP sets this before it stops the engine.
      (hunchentoot-shutdown-p acceptor)
      (gallop.core:connection-close-after-p c)))

(defun closing-headers (headers)
  "The headers alist HEADERS of an answer that ends its connection: a fresh
alist saying Connection: Close, without the Keep-Alive header Hunchentoot
may have added."
  (acons :connection "Close"
         (remove-if (lambda (entry) (member (car entry) '(:connection :keep-alive)))
                    headers)))

(defun write-response (original acceptor stream status-code &rest args &key headers cookies content)
  "SEND-RESPONSE (see the file's header): on a Gallop connection, what
Hunchentoot's own does, with the head written into the connection's buffer;
else ORIGINAL, Hunchentoot's own.  Either way, an answer whose connection
must end (ANSWER-CLOSES-P) says Connection: Close and ends the request loop,
whatever START-OUTPUT decided: a head that SEND-HEADERS writes (as
HANDLE-STATIC-FILE does) goes out before the handler returns, and a
keep-alive it promised while the server stops would bring the client's next
request to a connection the stop closes."
  (let ((c (if (typep stream 'gallop.core:connection) stream (request-connection))))
    (when (and c (/= status-code 101) (answer-closes-p acceptor c)
               (not (let ((value (cdr (assoc :connection headers))))
                      (and (stringp value) (connection-token-p value "close")))))
      (setf headers (closing-headers headers)
            args (list* :headers headers args))
      ;; The request loop reads the reply's header, and ends the
      ;; connection (SERVE-REQUESTS; a deferred answer, ANSWER-DEFERRED).
      (when (boundp 'hunchentoot:*reply*)
        (setf (hunchentoot:header-out :connection) "Close"))))
  (if (not (and (typep stream 'gallop.core:connection) (null hunchentoot:*header-stream*)))
      (progn
        ;; Every answer on a Gallop connection is counted for the metrics.
        (when (typep stream 'gallop.core:connection)
          (gallop.core:connection-count-answer stream status-code))
        (apply original acceptor stream status-code args))
      (let ((c stream))
        (when (and (= status-code 101) (not (gallop.core:connection-may-switch-p c)))
          ;; No thread for another switched connection (MAX-SWITCHED-
          ;; THREADS): 503, and the handler's next step (hunchensocket's
          ;; loop after a 101) does not begin.
          (setf (hunchentoot:return-code*) 503)
          (return-from write-response
            (write-response original acceptor stream 503
                            :headers (list (cons :retry-after "1") (cons :connection "close")
                                           (cons :content-type "text/plain; charset=utf-8"))
                            :content (load-time-value
                                      (map 'octets #'char-code
                                           (format nil "503 Service Unavailable~%"))
                                      t))))
        (gallop.core:connection-count-answer c status-code)
        ;; Hunchentoot's own steps, in its order:
        (when content
          (setf (hunchentoot:content-length*) (length content)))
        (let ((length (hunchentoot:content-length*)))
          (when length
            (let ((entry (assoc :content-length headers)))
              (if entry
                  (setf (cdr entry) length)
                  (push (cons :content-length length) headers)))))
        (hunchentoot:acceptor-log-access acceptor :return-code status-code)
        (hunchentoot:raw-post-data :force-binary t)
        (let ((line (hunchentoot-status-line status-code)))
          (gallop.core:connection-write-octets c line))
        (loop for (key . value) in headers
              when value
                do (write-header c (chunga:as-capitalized-string key)
                                 (if (typep value '(and fixnum unsigned-byte))
                                     value
                                     (header-value-string value))))
        (loop for (nil . cookie) in cookies
              do (write-header c "Set-Cookie" (header-value-string (hunchentoot-stringify-cookie cookie))))
        (gallop.core:connection-write-octets c gallop.core:+crlf-octets+)
        (when content
          (write-sequence content c)
          (finish-output c))
        (when (= status-code 101)
          ;; Switching Protocols: the handler speaks the next one on C.
          (switch-protocols c))
        c)))

;;; Wrapping Hunchentoot's function (compat.lisp checks it).

(wrap-hunchentoot-function (hunchentoot-send-response)
  (lambda (original &rest args) (apply #'write-response original args)))
