;;;; access-log.lisp -- the native API's access log (GALLOP:START's
;;;; :ACCESS-LOG): the Combined Log Format byte for byte, nginx's escaping
;;;; of what a client sent, JSON lines a JSON parser reads, and a file opened
;;;; again by its name for logrotate.

(in-package #:gallop-tests)

(in-suite production)

(defun logged-app (env)
  (if (string= (getf env :path-info) "/stream")
      (lambda (responder)
        (let ((writer (funcall responder '(200 (:content-type "text/plain")))))
          (funcall writer "Hey" :close nil)
          (funcall writer "!" :close t)))
      '(200 (:content-type "text/plain") ("Hey!"))))

(defun exchange-raw (port request &key head)
  "Send REQUEST (a string of octets as characters) on a fresh connection to
PORT and read the answer strictly; the connection then closes."
  (let ((socket (connect port)))
    (unwind-protect
         (let ((stream (usocket:socket-stream socket)))
           (write-sequence (map '(vector (unsigned-byte 8)) #'char-code request) stream)
           (force-output stream)
           (read-wire-or-error socket :close t :head-request head))
      (usocket:socket-close socket))))

(defun log-lines (path)
  "The lines of the file PATH, read as Latin-1."
  (with-open-file (in path :external-format :latin-1)
    (loop for line = (read-line in nil) while line collect line)))

(defun without-time (line)
  "LINE with its [time] replaced by [T], and whether that time had CLF's form."
  (let* ((open (position #\[ line))
         (close (and open (position #\] line :start open))))
    (if close
        (values (concatenate 'string (subseq line 0 open) "[T]" (subseq line (1+ close)))
                (cl-ppcre:scan "^\\d\\d/[A-Z][a-z]{2}/\\d{4}:\\d\\d:\\d\\d:\\d\\d \\+0000$"
                               (subseq line (1+ open) close)))
        (values line nil))))

(test the-access-log-writes-the-combined-log-format
  "One line per answer in nginx's combined format: what the client sent
that could break or forge a line (a quote, a backslash, a byte above 127)
is escaped as nginx escapes it (\\xHH); an absent Referer or User-Agent is
\"-\"; a HEAD answer sent 0 octets of body, a streamed one an unknown number."
  (let* ((path (merge-pathnames "access.log" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server)))
    (unwind-protect
         (progn
           (is (exact-answer-p
                (exchange-raw port (format nil "GET /yo?x=1 HTTP/1.1~C~CHost: x~C~CUser-Agent: ua \"q\" \\ ~C~C~CReferer: http://ref/~C~CConnection: close~C~C~C~C"
                                           #\Return #\Linefeed #\Return #\Linefeed
                                           (code-char #xE9) #\Return #\Linefeed
                                           #\Return #\Linefeed #\Return #\Linefeed
                                           #\Return #\Linefeed))
                "Hey!"))
           (exchange-raw port (crlf "HEAD /yo HTTP/1.1" "Host: x" "Connection: close") :head t)
           (exchange-raw port (crlf "GET /stream HTTP/1.1" "Host: x" "Connection: close")))
      (gallop:stop server))
    ;; GALLOP:STOP wrote what was queued.  Lines of one pass of the
    ;; writer come grouped by the worker that made them: sorted here.
    (let ((lines (sort (log-lines path) #'string< :key #'without-time)))
      (is (= 3 (length lines)) "~S" lines)
      (let ((expected (sort (list (format nil "127.0.0.1 - - [T] \"GET /yo?x=1 HTTP/1.1\" 200 4 \"http://ref/\" \"ua \\x22q\\x22 \\x5C \\xE9\"")
                                  "127.0.0.1 - - [T] \"HEAD /yo HTTP/1.1\" 200 0 \"-\" \"-\""
                                  "127.0.0.1 - - [T] \"GET /stream HTTP/1.1\" 200 - \"-\" \"-\"")
                            #'string<)))
        (loop for line in lines
              for want in expected
              do (multiple-value-bind (rest time-ok) (without-time line)
                   (is (string= want rest) "~S~%  expected ~S" line want)
                   (is-true time-ok "the time of ~S" line)))))))

(test the-access-log-writes-json-lines-a-parser-reads
  "With :ACCESS-LOG-FORMAT :JSON each line is one JSON object, whatever the
client sent (here a quote, a backslash and a byte above 127): Python's json
module reads it back to the same values."
  (let* ((path (merge-pathnames "access.json" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path :access-log-format :json)))
         (port (gallop:server-port server)))
    (unwind-protect
         (exchange-raw port (format nil "GET /yo HTTP/1.1~C~CHost: x~C~CUser-Agent: a\"b\\c~C~C~CConnection: close~C~C~C~C"
                                    #\Return #\Linefeed #\Return #\Linefeed (code-char #xE9)
                                    #\Return #\Linefeed #\Return #\Linefeed #\Return #\Linefeed))
      (gallop:stop server))
    (let ((output (uiop:run-program
                   (list "/usr/bin/python3" "-c"
                         "import json,sys
for line in open(sys.argv[1], encoding='ascii'):
    o = json.loads(line)
    del o['time']
    print(sorted(o.items()))"
                         (namestring path))
                   :output :string :error-output :string :ignore-error-status t)))
      (is (string= (format nil "[('bytes', 4), ('method', 'GET'), ('protocol', 'HTTP/1.1'), ~
                                ('referer', ''), ('remote_addr', '127.0.0.1'), ('status', 200), ~
                                ('uri', '/yo'), ('user_agent', 'a\"b\\\\c~C')]~%"
                           (code-char #xE9))
                   output)
          "~A" output))))

(test the-access-log-file-is-opened-again-by-its-name
  "After logrotate moves the file, GALLOP:REOPEN-ACCESS-LOGS makes the log
write to a new file of the same name: the line before goes to the moved
file, the line after to the new one."
  (let* ((path (merge-pathnames "rotated.log" (run-directory)))
         (moved (merge-pathnames "rotated.log.1" (run-directory)))
         (server (progn (dolist (p (list path moved)) (when (probe-file p) (delete-file p)))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server)))
    (unwind-protect
         (progn
           (exchange-raw port (crlf "GET /before HTTP/1.1" "Host: x" "Connection: close"))
           ;; The line was written (the writer's pass is 100 ms).
           (is (wait-until (lambda () (and (probe-file path) (log-lines path))) :timeout 10))
           (rename-file path moved)
           (gallop:reopen-access-logs)
           (is (wait-until (lambda () (probe-file path)) :timeout 10) "no new file")
           (exchange-raw port (crlf "GET /after HTTP/1.1" "Host: x" "Connection: close")))
      (gallop:stop server))
    (is (equal '("127.0.0.1 - - [T] \"GET /before HTTP/1.1\" 200 4 \"-\" \"-\"")
               (mapcar #'without-time (log-lines moved))))
    (is (equal '("127.0.0.1 - - [T] \"GET /after HTTP/1.1\" 200 4 \"-\" \"-\"")
               (mapcar #'without-time (log-lines path))))))

(test the-hunchentoot-front-end-keeps-hunchentoots-access-log
  "GALLOP:EASY-ACCEPTOR writes Hunchentoot's own access log lines, as a stock
HUNCHENTOOT:EASY-ACCEPTOR given the same requests writes them, byte for byte
but the time."
  (flet ((lines-of (class name)
           (let ((path (merge-pathnames name (run-directory))))
             (when (probe-file path) (delete-file path))
             (let ((server (make-instance class :address "127.0.0.1" :port 0
                                                :access-log-destination path
                                                :message-log-destination nil)))
               (hunchentoot:start server)
               (unwind-protect
                    (let ((port (port-of server)))
                      (exchange-raw port (crlf "GET /yo?name=x HTTP/1.1" "Host: x"
                                               "User-Agent: ua" "Referer: http://ref/"
                                               "Connection: close"))
                      (exchange-raw port (crlf "GET /no-such-page HTTP/1.1" "Host: x"
                                               "Connection: close")))
                 (hunchentoot:stop server)))
             (mapcar #'without-time (log-lines path)))))
    (let ((stock (lines-of 'hunchentoot:easy-acceptor "stock-access.log"))
          (gallop (lines-of 'gallop:easy-acceptor "gallop-access.log")))
      (is (= 2 (length stock)) "~S" stock)
      (is (equal stock gallop) "stock ~S~%gallop ~S" stock gallop))))

(test the-access-log-loses-no-line-of-many-workers
  "200 answers made at once by four clients on keep-alive connections (so
by several workers, each with its own buffer), and one with a User-Agent
of 3,000 characters (a line too long for a worker's scratch): every line
is in the file once, whole."
  (let* ((path (merge-pathnames "many.log" (run-directory)))
         (server (progn (when (probe-file path) (delete-file path))
                        (gallop:start #'logged-app :address "127.0.0.1" :port 0 :log nil
                                                   :access-log path)))
         (port (gallop:server-port server))
         (long (make-string 3000 :initial-element #\u)))
    (unwind-protect
         (progn
           (mapc #'sb-thread:join-thread
                 (loop for k below 4
                       collect (let ((k k))
                                 (sb-thread:make-thread
                                  (lambda ()
                                    (let ((socket (connect port)))
                                      (unwind-protect
                                           (dotimes (i 50)
                                             (send socket (crlf (format nil "GET /n-~D-~D HTTP/1.1" k i)
                                                                "Host: x"))
                                             (read-wire-or-error socket))
                                        (usocket:socket-close socket))))))))
           (exchange-raw port (crlf "GET /long HTTP/1.1" "Host: x"
                                    (format nil "User-Agent: ~A" long) "Connection: close")))
      (gallop:stop server))
    (let ((lines (mapcar #'without-time (log-lines path))))
      (is (= 201 (length lines)) "~D lines" (length lines))
      (is (equal (sort (loop for k below 4
                             append (loop for i below 50
                                          collect (format nil "127.0.0.1 - - [T] \"GET /n-~D-~D HTTP/1.1\" 200 4 \"-\" \"-\"" k i)))
                       #'string<)
                 (sort (remove-if-not (lambda (line) (search "/n-" line)) lines) #'string<)))
      (is (member (format nil "127.0.0.1 - - [T] \"GET /long HTTP/1.1\" 200 4 \"-\" \"~A\"" long)
                  lines :test #'string=)))))
