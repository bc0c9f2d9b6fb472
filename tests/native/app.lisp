;;;; app.lisp -- the native app API (GALLOP:START) over real sockets.

(in-package #:gallop-tests)

(def-suite native :in gallop :description "The native app API.")
(in-suite native)


(defun read-all-octets (stream)
  (let ((out (make-array 0 :element-type '(unsigned-byte 8) :adjustable t :fill-pointer 0)))
    (loop for b = (read-byte stream nil nil) while b do (vector-push-extend b out))
    out))

(defun env-echo-app (env)
  "Answers with a line per interesting environment entry."
  (let ((body (read-all-octets (getf env :raw-body))))
    (list 200 '(:content-type "text/plain; charset=utf-8")
          (list (format nil "method=~A~%path=~A~%query=~A~%uri=~A~%protocol=~A~%~
                             host=~A~%remote=~A~%x-test=~A~%content-length=~A~%body=~A~%"
                        (getf env :request-method) (getf env :path-info)
                        (getf env :query-string) (getf env :request-uri)
                        (getf env :server-protocol) (getf env :server-name)
                        (getf env :remote-addr) (gethash "x-test" (getf env :headers))
                        (getf env :content-length)
                        (map 'string #'code-char body))))))


(test native-get-builds-the-environment
  (with-app (server #'env-echo-app)
    (let ((response (get-request (native-port server) "/a%20b/%C3%A9t%C3%A9?x=1&y=%20" "X-Test: yes")))
      (is (= 200 (response-status response)))
      (is (equal "text/plain; charset=utf-8" (header response "Content-Type")))
      (is (header response "Date"))
      (let ((text (sb-ext:octets-to-string (coerce (response-body response) '(vector (unsigned-byte 8)))
                                           :external-format :utf-8)))
        (is (search "method=GET" text))
        (is (search (format nil "path=/a b/été~%") text))
        (is (search (format nil "query=x=1&y=%20~%") text))
        (is (search (format nil "uri=/a%20b/%C3%A9t%C3%A9?x=1&y=%20~%") text))
        (is (search "protocol=HTTP/1.1" text))
        (is (search "host=127.0.0.1" text))
        (is (search "remote=127.0.0.1" text))
        (is (search "x-test=yes" text))))))

(test native-post-bodies-content-length-and-chunked
  (with-app (server #'env-echo-app)
    (let ((response (request (native-port server)
                             (concatenate 'string
                                          (crlf "POST /p HTTP/1.1" "Host: x" "Content-Length: 11")
                                          "hello world"))))
      (is (search "body=hello world" (body-string response)))
      (is (search "content-length=11" (body-string response))))
    (let ((response (request (native-port server)
                             (concatenate 'string
                                          (crlf "POST /p HTTP/1.1" "Host: x" "Transfer-Encoding: chunked")
                                          (format nil "5;ext=1~C~Chello~C~C6~C~C world~C~C0~C~CX-Trailer: t~C~C~C~C"
                                                  #\Return #\Linefeed #\Return #\Linefeed
                                                  #\Return #\Linefeed #\Return #\Linefeed
                                                  #\Return #\Linefeed #\Return #\Linefeed
                                                  #\Return #\Linefeed)))))
      (is (= 200 (response-status response)))
      (is (search "body=hello world" (body-string response))))))

(test native-keep-alive-close-http-1.0-and-head
  (with-app (server (lambda (env) (declare (ignore env)) '(200 (:content-type "text/plain") ("Hey!"))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (dotimes (i 3)
               (send socket (crlf "GET / HTTP/1.1" "Host: x"))
               (let ((r (read-response socket)))
                 (is (= 200 (response-status r)))
                 (is (string= "Hey!" (body-string r)))))
             (send socket (crlf "HEAD / HTTP/1.1" "Host: x"))
             (let ((r (read-response socket :head-only t)))
               (is (= 200 (response-status r)))
               (is (equal "4" (header r "Content-Length"))))
             (send socket (crlf "GET / HTTP/1.1" "Host: x" "Connection: close"))
             (let ((r (read-response socket)))
               (is (equalp "close" (header r "Connection")))
               (is (string= "Hey!" (body-string r))))
             (is (closed-by-peer-p socket)))
        (usocket:socket-close socket)))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (crlf "GET / HTTP/1.0" "Connection: keep-alive"))
             (let ((r (read-response socket)))
               (is (equalp "keep-alive" (header r "Connection"))))
             (send socket (crlf "GET / HTTP/1.0"))
             (is (string= "Hey!" (body-string (read-response socket))))
             (is (closed-by-peer-p socket)))
        (usocket:socket-close socket)))
    (is (wait-until (lambda () (zerop (getf (gallop:stats server) :open)))))))

(test native-pipelined-requests-in-order
  (with-app (server (lambda (env) (list 200 nil (list (getf env :path-info)))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (format nil "~{~A~}" (loop for i below 20
                                                     collect (crlf (format nil "GET /~D HTTP/1.1" i)
                                                                   "Host: x"))))
             (dotimes (i 20)
               (is (string= (format nil "/~D" i) (body-string (read-response socket)))))
             ;; More than a buffer's worth (8 KiB) at once, in requests of 32
             ;; bytes, so that the first read ends exactly between two of
             ;; them: the server must go back to the socket for the rest,
             ;; not wait for an event that will not come.
             (send socket (format nil "~{~A~}" (loop for i below 600
                                                     collect (crlf (format nil "GET /~5,'0D HTTP/1.1" i)
                                                                   "Host: x"))))
             (is (= 600 (loop for i below 600
                              count (let ((r (handler-case (read-response socket)
                                               (error () nil))))
                                      (and r (string= (format nil "/~5,'0D" i)
                                                      (body-string r))))))))
        (usocket:socket-close socket)))))

(test native-host-and-method-per-request-on-one-connection
  ;; The Host of the last request is remembered per server (its string and
  ;; :SERVER-NAME reused while the octets are the same): a different Host,
  ;; of the same length or not, must still be seen as it is; and the method
  ;; must be right whether or not it is one of the common ones.
  (with-app (server (lambda (env)
                      (list 200 nil (list (format nil "~A ~A ~A"
                                                  (getf env :request-method)
                                                  (getf env :server-name)
                                                  (gethash "host" (getf env :headers)))))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (loop for (method host expected)
                   in '(("GET" "a.example:80" "GET a.example a.example:80")
                        ("GET" "a.example:80" "GET a.example a.example:80")
                        ("POST" "b.example:80" "POST b.example b.example:80")
                        ("PUT" "b.example" "PUT b.example b.example")
                        ("DELETE" "b.example" "DELETE b.example b.example")
                        ("OPTIONS" "[::1]:8080" "OPTIONS [::1] [::1]:8080")
                        ("GET" "[::1]" "GET [::1] [::1]")
                        ("PATCH" "a.example:80" "PATCH a.example a.example:80"))
                 do (send socket (crlf (format nil "~A / HTTP/1.1" method)
                                       (format nil "Host: ~A" host) "Content-Length: 0"))
                    (is (string= expected (body-string (read-response socket)))))
        (usocket:socket-close socket)))))

(test native-host-per-request-across-connections
  ;; The server's one Host memo, with connections that take turns and each
  ;; send a Host of their own (a proxy's, or virtual hosts): every request
  ;; must see its own Host and host part, whatever the request before it on
  ;; another connection sent; the same length in octets included.
  (with-app (server (lambda (env)
                      (list 200 '(:content-type "text/plain")
                            (list (format nil "~A ~A ~A" (getf env :server-name)
                                          (gethash "host" (getf env :headers))
                                          (getf env :remote-addr))))))
    (let ((sockets (loop repeat 3 collect (connect (native-port server))))
          (hosts '("a.example:80" "b.example:81" "[::1]:8080")))
      (unwind-protect
           (loop repeat 4
                 do (loop for socket in sockets
                          for host in hosts
                          do (send socket (crlf "GET / HTTP/1.1" (format nil "Host: ~A" host)))
                             (let* ((r (read-wire socket :persistent t))
                                    (expected (format nil "~A ~A 127.0.0.1"
                                                      (subseq host 0 (position #\: host :from-end t))
                                                      host)))
                               (is (= 200 (wire-status r)))
                               (is (equal "text/plain" (wire-header r "Content-Type")))
                               (is (equal (princ-to-string (length expected))
                                          (wire-header r "Content-Length")))
                               (is (string= expected (wire-body-string r)) "~A: ~S" host
                                   (wire-body-string r)))))
        (mapc #'usocket:socket-close sockets)))))

(test native-host-per-request-from-concurrent-clients
  ;; The same, with clients in threads of their own, so that workers read
  ;; and replace the server's memo at once: every answer must still name its
  ;; own request's Host (three of the four the same length in octets).
  (with-app (server (lambda (env)
                      (list 200 '(:content-type "text/plain")
                            (list (format nil "~A ~A" (getf env :server-name)
                                          (gethash "host" (getf env :headers)))))))
    (let* ((hosts '("a.example:80" "b.example:81" "c.example:82" "localhost"))
           (threads
             (loop for host in hosts
                   collect (let ((host host))
                             (sb-thread:make-thread
                              (lambda ()
                                (let ((socket (connect (native-port server)))
                                      (expected (format nil "~A ~A"
                                                        (subseq host 0 (or (position #\: host) (length host)))
                                                        host))
                                      (exact 0))
                                  (unwind-protect
                                       (dotimes (i 200 exact)
                                         (send socket (crlf "GET / HTTP/1.1" (format nil "Host: ~A" host)))
                                         (when (exact-answer-p (read-wire socket :persistent t)
                                                               expected)
                                           (incf exact)))
                                    (usocket:socket-close socket))))
                              :name (format nil "client ~A" host))))))
      (loop for host in hosts
            for thread in threads
            do (is (= 200 (sb-thread:join-thread thread :default -1))
                   "answers exact for ~A" host)))))

(test native-repeated-header-fields-are-joined
  ;; RFC 9110 5.3: a field sent twice means its values joined with ", ",
  ;; the field first in the head included (MAKE-ENV looks up only after its
  ;; first field), and a field's case does not make it another field.
  (with-app (server (lambda (env)
                      (let ((h (getf env :headers)))
                        (list 200 '(:content-type "text/plain")
                              (list (format nil "~A|~A|~A|~D"
                                            (gethash "x-first" h) (gethash "accept" h)
                                            (gethash "host" h) (hash-table-count h)))))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (loop for (head expected)
                   in '((("X-First: a" "Host: x" "X-FIRST: b" "Accept: */*" "x-first: c")
                         "a, b, c|*/*|x|3")
                        (("X-First: a" "X-First: b" "Host: x")
                         "a, b|NIL|x|2")
                        (("Host: x" "Accept: text/html" "Accept: */*")
                         "NIL|text/html, */*|x|2")
                        (("Host: x")
                         "NIL|NIL|x|1"))
                 do (send socket (apply #'crlf "GET / HTTP/1.1" head))
                    (let* ((r (read-wire socket :persistent t))
                           (body (wire-body-string r)))
                      (is (= 200 (wire-status r)))
                      (is (equal "text/plain" (wire-header r "Content-Type")))
                      (is (equal (princ-to-string (length (wire-body r)))
                                 (wire-header r "Content-Length")))
                      (is (string= expected body) "~S: ~S" head body)))
        (usocket:socket-close socket)))))

(test native-header-names-in-any-case
  ;; Names are matched against literals ignoring case: HOST is the Host the
  ;; server reads, cOnTeNt-LeNgTh frames the body, and the headers table has
  ;; lower-case keys either way.
  (with-app (server (lambda (env)
                      (let ((h (getf env :headers)))
                        (list 200 nil
                              (list (format nil "~A|~A|~A|~A|~A|~A"
                                            (getf env :server-name) (gethash "host" h)
                                            (gethash "content-length" h) (getf env :content-length)
                                            (gethash "x-mixed-case" h)
                                            (map 'string #'code-char
                                                 (read-all-octets (getf env :raw-body)))))))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (dolist (host '("HOST" "host" "hOsT"))
             (send socket (concatenate 'string
                                       (crlf "POST / HTTP/1.1" (format nil "~A: a.example:81" host)
                                             "cOnTeNt-LeNgTh: 5" "X-MIXED-Case: yes")
                                       "hello"))
             (is (string= "a.example|a.example:81|5|5|yes|hello"
                          (body-string (read-response socket)))
                 "with ~A" host))
        (usocket:socket-close socket)))))

(test native-general-head-path
  ;; A header value that is not a string, or a head larger than the output
  ;; buffer, takes the writer's general path (Content-Length written by
  ;; CONNECTION-WRITE-DECIMAL); the client must see the same answer.
  (let ((long (make-string 20000 :initial-element #\a)))
    (with-app (server (lambda (env)
                        (if (string= (getf env :path-info) "/long")
                            (list 200 (list :x-long long) (list "hello"))
                            (list 200 '(:x-count 42) (list "hello world")))))
      (let ((r (get-request (native-port server) "/count")))
        (is (equal "42" (header r "X-Count")))
        (is (equal "11" (header r "Content-Length")))
        (is (string= "hello world" (body-string r))))
      (let ((r (get-request (native-port server) "/long")))
        (is (equal long (header r "X-Long")))
        (is (equal "5" (header r "Content-Length")))
        (is (string= "hello" (body-string r)))))))

(test native-response-header-names-spelled-as-before
  ;; The common response header keywords are written from constants: each
  ;; must be spelled exactly as the general path spells any keyword.
  (dolist (name '(:content-type :content-length :location :set-cookie :cache-control
                  :last-modified :etag :expires :vary :content-encoding :content-disposition
                  :server :access-control-allow-origin :x-content-type-options :x-other-name))
    (is (equalp (gallop::ascii (concatenate 'string (string-capitalize (symbol-name name)) ": "))
                (gallop::header-name-octets name))
        "~S" name))
  (is (equalp (gallop::ascii "X-Given-As-String: ") (gallop::header-name-octets "X-Given-As-String"))))

(test native-responder-called-from-another-thread
  (let ((timer-threads '()))
    (with-app (server (lambda (env)
                        (if (string= (getf env :path-info) "/later")
                            (lambda (responder)
                              (push (sb-thread:make-thread
                                     (lambda ()
                                       (sleep 0.3)
                                       (funcall responder '(200 (:content-type "text/plain") ("later")))))
                                    timer-threads))
                            '(200 nil ("now")))))
      (let* ((port (native-port server))
             (later nil)
             (client (sb-thread:make-thread
                      (lambda () (setf later (get-request port "/later"))))))
        ;; While /later waits, its worker is free: other requests are served.
        (sleep 0.05)
        (is (string= "now" (body-string (get-request port "/now"))))
        (sb-thread:join-thread client)
        (is (= 200 (response-status later)))
        (is (string= "later" (body-string later))))
      ;; keep-alive across a delayed response
      (let ((socket (connect (native-port server))))
        (unwind-protect
             (progn
               (send socket (crlf "GET /later HTTP/1.1" "Host: x"))
               (is (string= "later" (body-string (read-response socket))))
               (send socket (crlf "GET /now HTTP/1.1" "Host: x"))
               (is (string= "now" (body-string (read-response socket)))))
          (usocket:socket-close socket))))
    (mapc #'sb-thread:join-thread timer-threads)))

(test native-streaming-writer
  (with-app (server (lambda (env)
                      (declare (ignore env))
                      (lambda (responder)
                        (let ((writer (funcall responder '(200 (:content-type "text/plain")))))
                          (sb-thread:make-thread
                           (lambda ()
                             (dotimes (i 3)
                               (funcall writer (format nil "chunk ~D;" i))
                               (sleep 0.02))
                             (funcall writer "end" :close t)))))))
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (dotimes (i 2)
             (send socket (crlf "GET / HTTP/1.1" "Host: x"))
             (let ((r (read-response socket)))
               (is (equalp "chunked" (header r "Transfer-Encoding")))
               (is (string= "chunk 0;chunk 1;chunk 2;end" (body-string r)))))
        (usocket:socket-close socket)))))

(defun streaming-app (env)
  "Streams its answer through the responder's writer, in the app's thread,
or with /later from another one once the app returned: 200, or with /empty
204, whose writer is given data too."
  (let ((path (getf env :path-info)))
    (lambda (responder)
      (let ((writer (funcall responder (list (if (string= path "/empty") 204 200)
                                             '(:content-type "text/plain")))))
        (flet ((write-all ()
                 (funcall writer "streamed ")
                 (funcall writer "body" :close t)))
          (if (string= path "/later")
              (sb-thread:make-thread #'write-all :name "later writer")
              (write-all)))))))

(test native-head-of-a-streamed-answer-keeps-the-connection
  ;; HEAD (or a 204) answered by a streamed response, and a GET pipelined
  ;; in the same write: the head alone, none of the writer's data, and the
  ;; GET answered on the same connection, which then ends as it asked.
  (with-app (server #'streaming-app)
    (dolist (case '(("HEAD" "/") ("HEAD" "/later") ("GET" "/empty") ("POST" "/empty")))
      (destructuring-bind (method path) case
        (let ((socket (connect (native-port server)))
              (what (format nil "~A ~A" method path)))
          (unwind-protect
               (progn
                 (send socket (concatenate 'string
                                           (crlf (format nil "~A ~A HTTP/1.1" method path)
                                                 "Host: x" "Content-Length: 0")
                                           (crlf "GET / HTTP/1.1" "Host: x" "Connection: close")))
                 (let ((first (read-wire-or-error socket :head-request (string= method "HEAD")
                                                         :persistent t)))
                   (is (and (wire-response-p first)
                            (= (if (string= path "/empty") 204 200) (wire-status first))
                            (wire-flag-p first :no-body)
                            (equal '("Date" "Content-Type") (mapcar #'car (wire-headers first)))
                            (equal "text/plain" (wire-header first "Content-Type")))
                       "~A: ~A" what (if (wire-response-p first) (latin1 (wire-head first)) first)))
                 (let ((second (read-wire-or-error socket :close t)))
                   (is (and (wire-response-p second) (= 200 (wire-status second))
                            (wire-flag-p second :chunked) (wire-flag-p second :eof)
                            (equal "streamed body" (wire-body-string second)))
                       "~A, then GET: ~A" what second)))
            (usocket:socket-close socket)))))))

(test native-file-body-with-sendfile
  (let ((path (format nil "/tmp/gallop-test-file-~D" (sb-posix:getpid))))
    (with-open-file (out path :direction :output :element-type '(unsigned-byte 8)
                              :if-exists :supersede)
      (dotimes (i 300000) (write-byte (mod (* i 7) 256) out)))
    (unwind-protect
         (with-app (server (lambda (env) (declare (ignore env))
                             (list 200 '(:content-type "application/octet-stream") (pathname path))))
           (let ((r (get-request (native-port server) "/file")))
             (is (= 200 (response-status r)))
             (is (= 300000 (length (response-body r))))
             (is (loop for i below 300000 always (= (aref (response-body r) i) (mod (* i 7) 256))))))
      (delete-file path))))

(test native-app-error-gives-500-logged-once
  (let ((log (make-string-output-stream)))
    (with-app (server (lambda (env)
                        (if (string= (getf env :path-info) "/fail")
                            (error "native deliberate failure")
                            '(200 nil ("ok"))))
                      :log log)
      (let ((socket (connect (native-port server))))
        (unwind-protect
             (progn
               (send socket (crlf "GET /fail HTTP/1.1" "Host: x"))
               (is (= 500 (response-status (read-response socket))))
               ;; and the connection serves the next request
               (send socket (crlf "GET /ok HTTP/1.1" "Host: x" "Connection: close"))
               (is (string= "ok" (body-string (read-response socket))))
               (is (closed-by-peer-p socket)))
          (usocket:socket-close socket)))
      (is (= 200 (response-status (get-request (native-port server) "/ok"))))
      (is (wait-until (lambda () (zerop (getf (gallop:stats server) :in-flight))))))
    (is (= 1 (count-matches "native deliberate failure" (get-output-stream-string log))))))

(test native-malformed-app-responses-give-500
  ;; A response list that is not (status headers [body]) is the app's bug:
  ;; 500, logged once each, and the server keeps serving.
  (let ((log (make-string-output-stream))
        (responses '(("/one" . (200))
                     ("/four" . (200 nil ("a") extra))
                     ("/dotted" . (200 nil . "x"))
                     ("/ok" . (200 nil ("ok"))))))
    (with-app (server (lambda (env)
                        (cdr (assoc (getf env :path-info) responses :test #'string=)))
                      :log log)
      (dolist (path '("/one" "/four" "/dotted"))
        (let ((r (get-request (native-port server) path)))
          (is (and r (= 500 (response-status r))) "~A: ~S" path (and r (response-status r)))))
      (is (string= "ok" (body-string (get-request (native-port server) "/ok")))))
    (is (= 3 (count-matches "is not (status headers" (get-output-stream-string log))))))

(test native-body-limits-and-expect-continue
  (with-app (server #'env-echo-app :max-body-bytes 100)
    ;; declared too large: refused before the body is sent
    (is (= 413 (response-status (request (native-port server)
                                         (crlf "POST / HTTP/1.1" "Host: x" "Content-Length: 1000"
                                               "Expect: 100-continue")))))
    ;; chunked and too large: refused while reading
    (is (= 413 (response-status
                (request (native-port server)
                         (concatenate 'string
                                      (crlf "POST / HTTP/1.1" "Host: x" "Transfer-Encoding: chunked")
                                      (format nil "C8~C~C~A~C~C0~C~C~C~C"
                                              #\Return #\Linefeed (make-string 200 :initial-element #\a)
                                              #\Return #\Linefeed #\Return #\Linefeed
                                              #\Return #\Linefeed))))))
    ;; 100-continue for an acceptable body
    (let ((socket (connect (native-port server))))
      (unwind-protect
           (progn
             (send socket (crlf "POST / HTTP/1.1" "Host: x" "Content-Length: 5" "Expect: 100-continue"))
             (let ((interim (read-response socket :head-only t)))
               (is (= 100 (response-status interim))))
             (send socket "12345")
             (is (search "body=12345" (body-string (read-response socket)))))
        (usocket:socket-close socket)))))

(test native-soft-stop-waits-for-a-delayed-response
  (let* ((threads (sb-thread:list-all-threads))
         (server (gallop:start (lambda (env) (declare (ignore env))
                                 (lambda (responder)
                                   (sb-thread:make-thread
                                    (lambda () (sleep 0.5)
                                      (funcall responder '(200 nil ("done")))))))
                               :address "127.0.0.1" :port 0 :log nil))
         (response nil)
         (client (sb-thread:make-thread
                  (lambda () (setf response (get-request (gallop:server-port server) "/"))))))
    (is (wait-until (lambda () (= 1 (getf (gallop:stats server) :in-flight)))))
    (gallop:stop server :soft t)
    (sb-thread:join-thread client)
    (is (string= "done" (body-string response)))
    (is (no-threads-left-p threads) "threads left: ~S" (threads-started-since threads))))

(test native-stack-exhaustion-gives-500
  (with-app (server (lambda (env)
                      (if (string= (getf env :path-info) "/deep")
                          (list 200 nil (list (princ-to-string (bottomless 0))))
                          '(200 nil ("ok")))))
    (is (= 500 (response-status (get-request (native-port server) "/deep"))))
    (is (= 200 (response-status (get-request (native-port server) "/ok"))))))

(test gallop-native-alone-exports-only-what-it-defines
  "Loaded alone (no Hunchentoot), gallop/native exports the native API and
no drop-in name without a definition; with the Hunchentoot layer the
drop-in names are exported too, each with its definition."
  (flet ((exports (system)
           (multiple-value-bind (output error-output status)
               (uiop:run-program
                (list "scripts/lisp.sh"
                      ;; The Hunchentoot this run tests (make test-ht13: 1.3.1).
                      "--eval" (format nil "(push ~S asdf:*central-registry*)"
                                       (namestring (asdf:system-source-directory "hunchentoot")))
                      "--eval" (format nil "(asdf:load-system ~S)" system)
                      "--eval" "(format t \"~&EXPORTS=~S~%\" (let (l) (do-external-symbols (s :gallop) (push (list (symbol-name s) (and (or (fboundp s) (find-class s nil)) t)) l)) (sort l #'string< :key #'first)))")
                :directory (asdf:system-source-directory "gallop")
                :output :string :error-output :string :ignore-error-status t)
             (is (eql 0 status) "loading ~A failed: ~A" system error-output)
             (let ((at (search "EXPORTS=" output)))
               (and at (let ((*read-eval* nil))
                         (read-from-string output t nil :start (+ at (length "EXPORTS=")))))))))
    (let ((native (exports "gallop/native"))
          (full (exports "gallop")))
      (is (equal '("ACCEPT-WEBSOCKET" "AFTER" "CANCEL-TIMER" "DRAIN" "ENV-SOCKET"
                   "HANDLER-TIMEOUT" "METRICS-APP" "METRICS-TEXT" "READINESS-RESPONSE"
                   "READY-P" "REOPEN-ACCESS-LOGS" "REOPEN-LOGS-ON-SIGHUP" "RUNNING-SERVERS"
                   "SERVER" "SERVER-ADDRESS" "SERVER-POOL"
                   "SERVER-PORT" "SET-MEMORY-LIMIT" "SOCKET-CLOSE"
                   "SOCKET-CLOSE-CALLBACK" "SOCKET-PENDING" "SOCKET-READ-CALLBACK"
                   "SOCKET-WRITE" "START" "STATS" "STOP" "STOP-ALL-SOFTLY" "STOP-ON-SIGTERM"
                   "WEBSOCKET" "WEBSOCKET-REQUEST-P"
                   "WS-BROADCAST" "WS-CLOSE" "WS-ENV" "WS-PENDING" "WS-PING" "WS-PROTOCOL" "WS-SEND"
                   "WS-USER-DATA")
                 (mapcar #'first native)))
      (is (every #'second native) "exported without a definition: ~S"
          (remove-if #'second native))
      (is (subsetp '("ACCEPTOR" "EASY-ACCEPTOR" "SSL-ACCEPTOR" "EASY-SSL-ACCEPTOR" "TASKMASTER")
                   (mapcar #'first full) :test #'string=))
      (is (every #'second full) "exported without a definition: ~S"
          (remove-if #'second full)))))
